"""What is done with committed checkpoints, orchestrator side: the validation gate, what a checkpoint says about
itself, evaluation, export (Hugging Face) and the MLflow model registry."""
