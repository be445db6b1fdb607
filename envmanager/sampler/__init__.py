"""Trajectories for learners: ``Sampler`` (garage-style collection with a parent-side batched
policy), ``WorkerPolicySampler`` (the policy in the workers: whole fragments per request),
``TransitionBatch`` / ``EpisodeBatch``, ``LearnerFeed`` (a learner thread with back-pressure) and
``Stats``. Built on the core's batch level; the core never imports this."""

from envmanager.sampler.batches import EpisodeBatch, TransitionBatch
from envmanager.sampler.learner import LearnerError, LearnerFeed, LearnerStarvedError
from envmanager.sampler.sampler import Sampler
from envmanager.sampler.stats import Stats
from envmanager.sampler.worker_policy import WorkerPolicySampler

__all__ = ["EpisodeBatch", "LearnerError", "LearnerFeed", "LearnerStarvedError", "Sampler", "Stats", "TransitionBatch",
           "WorkerPolicySampler"]
