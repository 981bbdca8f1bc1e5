"""Many candidates against one reference (`evalsuite compare`): observed once, run where asked (`local`, Ray),
written side by side. Imports `pipeline` and `reporting` and what they stand on."""
