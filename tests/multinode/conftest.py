"""The search world of tests/trainer/test_search_e2e.py (BM25 server, warmed-up model, questions)."""

from tests.trainer.test_search_e2e import search_world  # noqa: F401 -- a fixture, shared as is
