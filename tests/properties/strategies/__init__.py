"""The shared Hypothesis strategies, one module per area, re-exported here.

Import them as ``from tests.properties.strategies import metadata as md_st`` (or the area
module of your part).
"""

from tests.properties.strategies import graphs, kernels, metadata, prefill, runtime

__all__ = ["graphs", "kernels", "metadata", "prefill", "runtime"]
