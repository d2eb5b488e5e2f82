from ckpttool.cli import main

main()
