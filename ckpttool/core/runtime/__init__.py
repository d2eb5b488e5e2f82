"""How operations run: forked shares, torch threads, progress and the report schema, and
URLs wrapped around every command."""
