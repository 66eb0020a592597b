"""`tandem train-draft`: EAGLE and Medusa draft heads for a target model, trained by
self-distillation (the target's own greedy answers to ShareGPT prompts and its hidden states),
resumable across sittings, written in the public checkpoint formats tandem loads."""
