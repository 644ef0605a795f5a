"""Measuring what the library does on the machine at hand: an application layer over it.

* `roofline`: what a target forward costs against the memory and compute rooflines, on random
  weights of real shape (`launch/bench.py cost-curve`, `launch/bench.py device`).
* `sensitivity`: quantization sensitivity per layer and module kind, and the cheapest policy
  under a KL budget (`launch/bench.py quant-profile`).
"""
