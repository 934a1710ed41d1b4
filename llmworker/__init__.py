"""What runs beside an LLM engine (docs/worker.md).

The simulated engine, the sidecar agent and its proxy, worker-side admission. It imports
the router's event schema and publisher; no router plane imports it.
"""
