"""What is scored and asked, read from files: the text corpus, chat files, a pack's calibration set, the Hub
kept offline. Imports `errors` only."""
