"""Drafts of dyspec's own: the feature draft, published EAGLE drafts and Medusa heads."""
