import torch

from dyspec.core.tree import Tree


def test_tree_structure_and_mask():
    tree = Tree.root(10)
    a = tree.add(0, 11, 0.5)
    b = tree.add(0, 12, 0.25)
    c = tree.add(a, 13, 0.5)
    assert tree.depths == [0, 1, 1, 2]
    assert tree.values == [1.0, 0.5, 0.25, 0.25]
    assert tree.children(0) == [a, b] and tree.children(a) == [c]
    assert tree.path(c) == [a, c] and tree.path(0) == []
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(tree.ancestor_mask(), expected)
