"""The bundled demo dataset, generated in the real COYO format with real-data
defects (``generate``). Internal: use ``hf_pipeline.generate_demo``.
"""
