"""Trace-driven simulation of pslink against per-job static parameter servers (``pslink simulate``).

- :mod:`pslink.sim.trace`: the Philly trace (packaged) or any CSV of jobs; windows over it.
- :mod:`pslink.sim.models`: AlexNet, VGG19, ResNet-50, BERT-base: tensors and iteration times.
- :mod:`pslink.sim.costmodel`, :mod:`pslink.sim.calibrate`: Aggregator CPU per byte, measured on
  the real Aggregator core.
- :mod:`pslink.sim.workload`: trace rows -> jobs with workers, servers, tasks and costs.
- :mod:`pslink.sim.engine`: the event loop; pslink is the live ControlPlane on simulated time.
- :mod:`pslink.sim.metrics`, :mod:`pslink.sim.plots`: the figures (plots need matplotlib).

docs/simulator.md describes the model, its assumptions and the results.
"""
