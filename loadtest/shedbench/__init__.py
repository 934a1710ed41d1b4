"""The overload benchmarks' parts: one stack, one client, one sweep, one results writer.

``python -m loadtest.overload`` (thresholds off and on, and recovery after overload) and
``python -m loadtest.mixed`` (request classes) are thin entry points over these modules:

- :mod:`.config`: :class:`Config`, the workload and the run's shape;
- :mod:`.workers`: the LLM workers behind Envoy (:class:`Workers`): the simulated engine
  (:class:`SimWorkers`) or llama.cpp's ``llama-server`` with its agent (:class:`LlamaWorkers`);
- :mod:`.stack`: Envoy, the extproc and the workers on free 127.0.0.1 ports;
- :mod:`.client`: one streaming chat completion and what came back (:class:`Outcome`);
- :mod:`.arrivals`: closed-loop clients and seeded Poisson arrivals, bounded in count and time;
- :mod:`.capacity`: the unloaded reference and the closed-loop capacity sweep;
- :mod:`.stats`: percentiles and one overload cell's numbers;
- :mod:`.recovery`: probes after an overload phase, and the time until requests are admitted;
- :mod:`.classes`: mixed traffic with request classes and retrying clients;
- :mod:`.report`: the markdown tables; :mod:`.plots`: the PNG plots;
  :mod:`.results`: progress lines and the files under ``--out``.
"""
