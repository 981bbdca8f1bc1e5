"""The command line: a thin layer over `evalsuite.api` that parses options, shows progress and maps errors to
exit codes. The top of the house beside the API."""
