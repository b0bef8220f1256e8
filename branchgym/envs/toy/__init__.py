"""Toy environments with exact values: TreeMDP and its text twin."""

from branchgym.envs.toy.text_tree_mdp import TextTreeMDP
from branchgym.envs.toy.tree_mdp import TreeMDP, TreeStructure

__all__ = ["TreeMDP", "TextTreeMDP", "TreeStructure"]
