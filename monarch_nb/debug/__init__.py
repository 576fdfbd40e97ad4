"""debug package."""
