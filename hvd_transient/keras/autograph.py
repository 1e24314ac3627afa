"""Keep TensorFlow's AutoGraph out of Horovod's code, so that a worker's first step comes sooner.

Keras traces its train step with AutoGraph, which by default rewrites every function the step calls that is
not TensorFlow's or Keras's own: Horovod's ``DistributedOptimizer`` brings in its allreduce, broadcast and
compression helpers, a few hundred conversions. On a 2-core machine with three workers starting at once that
is 2-3 s of every cold start (a relaunch, a join without a standby, a standby's warm-up). Horovod's functions
are written for graph mode (they build their own ``tf.cond``), so calling them unconverted builds the same
graph. TensorFlow offers no public switch for a whole package; its conversion rules are the one place, and
where they are missing (another TensorFlow) the step is traced as before.

The rules only cover calls made from converted code. The optimizer's gradient allreduce is a ``tf.function``
of its own, which AutoGraph converts whatever the rules say (as if the user had asked for it): 2 s of CPU per
worker start, for a function whose loops and branches are over Python lists and flags, never tensors.
:func:`skip_horovod_conversion` given the optimizer marks that function as AutoGraph's own output, which
AutoGraph calls as it is (what ``tf.autograph.experimental.do_not_convert`` does to the function it wraps).
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

PACKAGE = "horovod"


def skip_horovod_conversion(optimizer: Any = None) -> bool:
    """Have AutoGraph call Horovod's functions as they are (idempotent). True if the rule is in place.

    ``optimizer``: a Horovod ``DistributedOptimizer`` whose own ``tf.function`` (the gradient allreduce) is
    to be traced unconverted too; anything else is left alone."""
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
    if optimizer is not None:
        _mark_horovod_functions(optimizer)
    return True


def horovod_functions(optimizer: Any) -> list[Any]:
    """The Python functions behind the ``tf.function`` attributes of ``optimizer`` that Horovod defined."""
    found = []
    for value in vars(optimizer).values() if hasattr(optimizer, "__dict__") else ():
        python_function = getattr(value, "python_function", None)  # a tf.function's own
        module = getattr(python_function, "__module__", None) or ""
        if callable(python_function) and (module == PACKAGE or module.startswith(PACKAGE + ".")):
            found.append(python_function)
    return found


def _mark_horovod_functions(optimizer: Any) -> None:
    try:
        from tensorflow.python.autograph.impl.api import autograph_artifact
    except ImportError:  # pragma: no cover - a TensorFlow without it
        log.debug("AutoGraph's artifact marker is not available: the optimizer's allreduce stays converted")
        return
    for function in horovod_functions(optimizer):
        autograph_artifact(function)
