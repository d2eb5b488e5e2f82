"""Output tensors other than the stored ones: LoRA folds and adapters, --names maps,
save_pretrained's hub layout, and the derived tensors they are computed as."""
