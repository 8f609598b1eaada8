"""Training data: sources read into documents, tokenized once into a shared cache, packed into windows with their boundaries."""
