"""The route machinery: the stage graph and its routes (graph.py), the pipeline that runs work
along a route (pipeline.py), and how one stage's output is cut into the next one's requests
(chunkers.py, with the text segmenter, segmenter.py). It knows stages by their edge types,
never a session: the orchestrator drives it."""
