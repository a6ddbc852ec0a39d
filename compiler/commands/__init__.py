"""One module per CLI subcommand; option groups shared between them live in `options`."""
