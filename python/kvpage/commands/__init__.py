"""The interactive parts of the `kvpage` command (kvpage.cli parses the flags): chat and demo."""
