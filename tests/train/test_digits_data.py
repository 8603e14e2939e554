"""The digits shipped in kfac_hpc/data are scikit-learn's, value for value, and the default
dataset loads them without scikit-learn."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from sklearn.datasets import load_digits

from kfac_hpc.train.data import digits_arrays
from tests.conftest import clean_env


def test_shipped_digits_equal_scikit_learns_copy():
    images, labels = digits_arrays()
    expected_images, expected_labels = load_digits(return_X_y=True)
    assert images.shape == (1797, 64) and labels.shape == (1797,)
    np.testing.assert_array_equal(images.astype(np.float64), expected_images)
    np.testing.assert_array_equal(labels.astype(np.int64), expected_labels)


def test_the_default_dataset_loads_with_sklearn_unimportable():
    code = (
        "import sys; sys.modules['sklearn'] = None\n"
        "from kfac_hpc.train.config import load_config\n"
        "from kfac_hpc.train.workloads import load_data\n"
        "data = load_data(load_config(None, {}))\n"
        "print(data.name, data.shape, data.num_classes, data.train_len, data.test_len)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["digits", "(1,", "8,", "8)", "10", "1437", "360"]
