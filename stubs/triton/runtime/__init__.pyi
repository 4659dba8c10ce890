from . import jit as jit
