"""Groups with delayed global sync (``sync="local:T"``, :mod:`pslink.core.worker.groups`) for TensorFlow:
after each step, the variables go to the groups' sync, which averages them every T steps.
ParameterServiceStrategy does it after each ``run``; the Keras DistributedOptimizer after each
``apply`` (a step of ``model.fit`` or of a custom loop)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from pslink.core.worker.groups import GroupAgent


@tf.autograph.experimental.do_not_convert
def end_group_step(agent, variables: list) -> None:
    """Hand ``variables`` (the same, in one order, on every worker) to ``agent``'s groups' sync,
    if it is a group's Agent; their average comes back every T steps. In a tf.function: an op
    that runs after the step's updates (stateful ops keep their program order) and assigns only
    when the step synced."""
    variables = [v for v in variables if tf.as_dtype(v.dtype).is_floating]  # Keras names its dtypes
    if not isinstance(agent, GroupAgent) or not variables:
        return
    names = [f"tf/{i}" for i in range(len(variables))]  # the order they were made: alike on every worker

    def averaged(read) -> list | None:
        """The groups' average if this step syncs (``read()`` gives the values then), else None."""
        arrays = {}

        def copies():
            arrays.update(zip(names, (np.array(value, copy=True) for value in read())))
            return arrays

        return list(arrays.values()) if agent.end_step(copies) else None

    if tf.executing_eagerly():
        values = averaged(lambda: [v.numpy() for v in variables])
        for variable, value in zip(variables, values or ()):
            variable.assign(value)
        return

    def end_step(*values):
        synced = averaged(lambda: values)
        return (*(values if synced is None else synced), np.bool_(synced is not None))

    *new_values, synced = tf.numpy_function(end_step, [tf.convert_to_tensor(v) for v in variables],
                                          [tf.as_dtype(v.dtype) for v in variables] + [tf.bool], stateful=True,
                                          name="pslink_group_sync")

    def assign():
        with tf.control_dependencies([v.assign(tf.reshape(a, v.shape)) for v, a in zip(variables, new_values)]):
            return tf.constant(True)

    tf.cond(tf.reshape(synced, []), assign, lambda: tf.constant(False))
