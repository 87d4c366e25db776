"""Pure decisions about offloaded experts: the policy protocol, MoE-SpAc and the baselines.

Nothing here owns time, memory or a link: a policy plans a layer, feeds a prefetch queue and
names eviction victims; the layer driver (`moespec.offload.driver`) enforces the rest.
"""
