"""``meshctl``'s commands, one module per group; :mod:`serve_app.cli` builds the parser from
them and maps their errors to the exit status."""
