"""The OpenAI HTTP surface: request models (`protocol`), errors (`errors`), SSE and
response building (`stream`), the FastAPI gateway (`gateway`), the prefill→decode
path behind it (`pipeline`), its Prometheus metrics (`metrics`) and settings (`config`)."""
