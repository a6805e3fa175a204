"""The custom reward hook: loading by path + name, keyword calls, kwargs, pickling, clear errors."""

from __future__ import annotations

import pickle

import pytest

from grpo_npu.reward import FileFunction, load_function, make_compute_score

USER_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return {"score": float(solution_str.strip() == ground_truth) + bonus, "source": data_source,
            "tag": (extra_info or {}).get("tag")}

def length_reward(solution_str, ground_truth, data_source, extra_info):
    return float(len(solution_str))

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FILE)
    return path


def test_loads_by_path_and_name(user_file):
    fn = load_function(user_file)
    assert fn("src", "7", "7")["score"] == 1.0
    other = load_function(str(user_file), "length_reward")
    assert other(solution_str="abc", ground_truth="", data_source="", extra_info=None) == 3.0


def test_make_compute_score_calls_by_keyword_with_kwargs(user_file):
    fn = make_compute_score(str(user_file), "compute_score", {"bonus": 0.5})
    assert fn("my_source", " 7 ", "7", {"tag": "t"}) == {"score": 1.5, "source": "my_source", "tag": "t"}
    # parameters in another order still get the right values: the call is by keyword
    assert make_compute_score(str(user_file), "length_reward")("ds", "abcd", "gt", None) == 4.0


def test_file_function_pickles_as_its_path(user_file):
    fn = FileFunction(user_file, "compute_score", {"bonus": 1.0})
    blob = pickle.dumps(fn)
    assert str(user_file).encode() in blob and b"def compute_score" not in blob
    again = pickle.loads(blob)
    assert again("s", "1", "1")["score"] == 2.0


def test_same_stem_in_two_folders_do_not_shadow(tmp_path):
    for name, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "reward.py").write_text(f"def compute_score(**kw):\n    return {value}\n")
    a = make_compute_score(str(tmp_path / "a" / "reward.py"))
    b = make_compute_score(str(tmp_path / "b" / "reward.py"))
    assert (a("s", "x", "y", None), b("s", "x", "y", None)) == (1.0, 2.0)


def test_errors_name_the_path_and_function(user_file, tmp_path):
    missing = tmp_path / "nope.py"
    with pytest.raises(FileNotFoundError, match=r"custom_reward_function.path=.*nope.py does not exist"):
        load_function(missing)
    with pytest.raises(FileNotFoundError, match=r"custom_reward_function.path=.* is a directory: expected a Python file"):
        load_function(tmp_path)
    with pytest.raises(AttributeError, match=r"custom_reward_function.name='score_fn': .*my_reward.py has no "
                                             r"function of that name; it defines \['compute_score', 'length_reward'\]"):
        load_function(user_file, "score_fn")
    with pytest.raises(AttributeError, match="name='NOT_A_FUNCTION'"):
        load_function(user_file, "NOT_A_FUNCTION")
    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(:\n")
    with pytest.raises(ImportError, match=r"custom_reward_function.path=.*broken.py failed to import: SyntaxError"):
        load_function(broken)
    raising = tmp_path / "raising.py"
    raising.write_text("import not_a_real_module_xyz\n")
    with pytest.raises(ImportError, match=r"raising.py failed to import: ModuleNotFoundError"):
        make_compute_score(str(raising))
