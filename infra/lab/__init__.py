"""``tandem lab``: many hosts on one machine, as network namespaces on bridges (``network.py``), for tests
and benchmarks that need real addresses, real partitions and two regions (issue 38's foundation)."""

from infra.lab.network import Host, Lab, LabSpec

__all__ = ["Host", "Lab", "LabSpec"]
