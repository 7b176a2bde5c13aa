"""Recipes that make what a run starts from (the base policy), built on the
actors' agent loop; ``deploy`` runs them. Nothing below ``deploy`` imports
this package."""
