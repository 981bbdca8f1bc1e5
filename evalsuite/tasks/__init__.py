"""Built-in task plugins; importing this package registers them."""

from evalsuite.tasks import ppl  # noqa: F401
from evalsuite.tasks import smoke  # noqa: F401
