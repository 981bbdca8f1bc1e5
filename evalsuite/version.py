"""The version of evalsuite, in a module of its own so that any floor may name it without importing the
package face (`evalsuite/__init__.py`, which sits on the top floor)."""

__version__ = "0.1.0"
