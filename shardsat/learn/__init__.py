"""Learning the prior over layouts (issue 13): its corpus and training."""
