from mtkc.cli import entry

entry()
