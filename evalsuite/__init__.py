"""evalsuite: does this quantized checkpoint still behave like its BF16 source?"""

__version__ = "0.1.0"
