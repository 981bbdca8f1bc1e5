"""Built-in task plugins; importing this package registers them."""

from evalsuite.tasks import ppl
from evalsuite.tasks import smoke
from evalsuite.tasks import vision
from evalsuite.tasks import tensors
from evalsuite.tasks import intref
