"""The node daemon: node metrics, http_sd discovery of live ranks, job submission.

``client`` (rank registration) is light; the rest needs the ``daemon`` extra (FastAPI).
"""
