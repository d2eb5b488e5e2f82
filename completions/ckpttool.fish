function __ckpttool_complete
    set -l found (env _CKPTTOOL_COMPLETE=complete_fish _TYPER_COMPLETE_FISH_ACTION=get-args \
        _TYPER_COMPLETE_ARGS=(commandline -cp) ckpttool)
    if test -n "$found"  # one empty line when it has no candidate
        printf '%s\n' $found
    else
        __fish_complete_path (commandline -ct)
    end
end
complete --command ckpttool --no-files --arguments '(__ckpttool_complete)'
