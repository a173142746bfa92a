"""Drawings of what real runs returned: per-rank tensor grids, step traces, timelines, topologies.

viz draws data it is handed and never launches ranks; collectives, training and labs never import it.
"""
