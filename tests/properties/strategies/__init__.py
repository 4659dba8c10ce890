"""The shared Hypothesis strategies, one module per area, re-exported here.

Import strategies as ``from tests.properties import strategies as hst`` or from the area
module directly.
"""
