from . import interpreter as interpreter
from . import jit as jit
