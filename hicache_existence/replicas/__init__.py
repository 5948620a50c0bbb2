"""TP replicas: order-sensitive digests of a replica (``digest``) and the
cross-rank checks that compare them (``divergence``; torch imported lazily)."""
