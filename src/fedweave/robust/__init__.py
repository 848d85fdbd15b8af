"""Byzantine clients and robust aggregation (docs/robustness.md).

``faults.byzantine`` makes a fixed share of the clients attackers (:mod:`fedweave.robust.attacks`, registry
``ATTACKS``); the ``aggregator`` section picks the server's reduction of the round's client updates
(:mod:`fedweave.robust.aggregators`, registry ``AGGREGATORS``). :mod:`fedweave.robust.stage` joins them to
a family's server round.
"""

from fedweave.robust import aggregators, attacks
from fedweave.robust.stage import RobustStage, attackers, build, check, poisoned_data

__all__ = ["RobustStage", "aggregators", "attackers", "attacks", "build", "check", "poisoned_data"]
