"""The README's documented import path of the link models (``from moeflow.bench.linkmodel
import load_fits``): the code lives in :mod:`moeflow.measure.linkmodel`, the measurement core
below the tuner, Parm and HECATE. Nothing in the package imports this module."""

from moeflow.measure.linkmodel import SCHEMA, AlphaBeta, fit_alpha_beta, fit_record, load_fits, \
    save_fits

__all__ = ["SCHEMA", "AlphaBeta", "fit_alpha_beta", "fit_record", "load_fits", "save_fits"]
