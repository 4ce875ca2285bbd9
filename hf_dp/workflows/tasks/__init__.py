"""The two tasks the study and recipes run: sequence classification and causal language modeling."""
