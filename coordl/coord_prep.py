"""Coordinated prep (CoorDL §4.2, ``hp_group``): the jobs of a hyperparameter search on one server share each
epoch's prepared minibatches, each preparing only its share. Its machinery is in ``coordl._group``."""

from coordl._group.membership import ALONE, NOT_MINE, EpochTicket, GroupStats, HPGroup, cleanup_stale, epoch_plan, \
    group_segment_name, list_groups, remove_group

__all__ = ["ALONE", "NOT_MINE", "EpochTicket", "GroupStats", "HPGroup", "cleanup_stale", "epoch_plan",
           "group_segment_name", "list_groups", "remove_group"]
