"""The blocks: a field integrated (continuous, stochastic, per-sample) or stepped (discrete), the result type
they return, and what a call collects on the way (stopping, regularisers, non-finite checks)."""
