"""Keep TensorFlow's AutoGraph out of Horovod's code, so that a worker's first step comes sooner.

Keras traces its train step with AutoGraph, which by default rewrites every function the step calls that is
not TensorFlow's or Keras's own: Horovod's ``DistributedOptimizer`` brings in its allreduce, broadcast and
compression helpers, a few hundred conversions. On a 2-core machine with three workers starting at once that
is 2-3 s of every cold start (a relaunch, a join without a standby, a standby's warm-up). Horovod's functions
are written for graph mode (they build their own ``tf.cond``), so calling them unconverted builds the same
graph. TensorFlow offers no public switch for a whole package; its conversion rules are the one place, and
where they are missing (another TensorFlow) the step is traced as before.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

PACKAGE = "horovod"


def skip_horovod_conversion() -> bool:
    """Have AutoGraph call Horovod's functions as they are (idempotent). True if the rule is in place."""
    try:
        from tensorflow.python.autograph.core import config
    except ImportError:  # pragma: no cover - a TensorFlow without the module
        log.debug("AutoGraph's conversion rules are not available: Horovod's functions stay converted")
        return False
    rules = getattr(config, "CONVERSION_RULES", None)
    if not isinstance(rules, tuple) or not hasattr(config, "DoNotConvert"):  # pragma: no cover
        log.debug("AutoGraph's conversion rules have another form: Horovod's functions stay converted")
        return False
    if not any(isinstance(rule, config.DoNotConvert) and rule.matches(PACKAGE) for rule in rules):
        config.CONVERSION_RULES = (config.DoNotConvert(PACKAGE),) + rules
    return True
