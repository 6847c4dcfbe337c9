"""A step's host<->device traffic: the one staged upload and the one read (Transfers). Below the
runner and the sampler, which both stage into it, so neither room imports the other for it."""
