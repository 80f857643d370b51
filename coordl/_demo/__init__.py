"""What ``coordl demo`` runs on: synthetic ImageNet-like folders and an emulated slow store."""
