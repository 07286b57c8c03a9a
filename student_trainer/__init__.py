"""The student side: the client that reaches a teacher, and a distillation trainer built on it."""

from student_trainer.client import TeacherClient, TeacherInfo, TeacherOutput
from student_trainer.errors import TeacherError

__all__ = ["TeacherClient", "TeacherInfo", "TeacherOutput", "TeacherError"]
