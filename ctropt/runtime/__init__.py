"""Running models: backends, verification inputs, output comparison."""

from .buckets import BucketedSession
from .inputs import DEFAULT_BATCH, analyze_inputs, generate_inputs, load_inputs, model_input_facts, store_input_facts
from .session import BACKENDS, Runner, run_model
from .verify import DEFAULT_ATOL, DEFAULT_RTOL, OutputDiff, all_ok, compare_outputs, summary

__all__ = ["BACKENDS", "BucketedSession", "DEFAULT_ATOL", "DEFAULT_BATCH", "DEFAULT_RTOL", "OutputDiff", "Runner", "all_ok", "analyze_inputs",
           "compare_outputs", "generate_inputs", "load_inputs", "model_input_facts", "run_model", "store_input_facts", "summary"]
