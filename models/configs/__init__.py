"""Model configuration files shipped with neo (Hugging Face config.json shapes)."""
