"""The teacher server: a frozen Hugging Face causal LM served to student training jobs."""
